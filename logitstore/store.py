"""The store: versioned sparse teacher distributions on Icechunk (transactional Zarr v3).

Layout of one store (one Icechunk repository, plus the Parquet indexes beside it, see `index.py`):

    /                                   attrs["logitstore"]: format version, creation time, writer
    /teachers/<name>/                   attrs["logitstore_teacher"]: `TeacherMeta` (hashes, vocab, sparsity, codec)
    /teachers/<name>/code_of_id         uint32 [vocab]   the codec's id renumbering (frequency order)
    /teachers/<name>/tokenizer          uint8  [bytes]   tokenizer.json, so `show` can decode without the model
    /teachers/<name>/parts/<part>/...   one immutable group per write: the arrays of `codec.EncodedSamples`
/teachers/<name>/students/<s>/      attrs["logitstore_student"]: a student tokenizer of this teacher
                                    (name, hash, vocab size, the mapped share of the teacher's mass)
/teachers/<name>/students/<s>/tokenizer  uint8 [bytes]  its tokenizer.json
/teachers/<name>/students/<s>/vocab_map  int32 [vocab]  teacher id -> student id with identical bytes, or -1
/teachers/<name>/parts/<part>/students/<s>/ids     int32 [N]    the samples' student token ids
/teachers/<name>/parts/<part>/students/<s>/groups  int32 [4 G]  alignment groups (t0, t1, s0, s1)

Every write adds new part groups and never touches existing ones, so concurrent writers (and Icechunk
forks in the distributed build) change disjoint Zarr paths. A version is an Icechunk snapshot whose
commit metadata names its sample index; the commit is the only moment a change becomes visible.
Versions are resolved as: tag, then branch, then snapshot id.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import icechunk
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from logitstore import codec, index, rawwrite
from logitstore.bounded import (
    bounded_store,
    create_repository,
    icechunk_failure,
    is_panic,
    open_repository,
    repository_exists,
    root_cause,
)
from logitstore.codec import CodecParams, EncodedSamples
from logitstore.errors import (
    ConflictError,
    DamagedDataError,
    DuplicateSampleError,
    IncompatibleStoreError,
    InvalidSampleError,
    LogitstoreError,
    SampleNotFoundError,
    StorageError,
    StoreNotFoundError,
    VersionNotFoundError,
)
from logitstore.location import Location, commit_lock
from logitstore.samples import SparseSamples, StudentTokens
from logitstore.sparsity import MODES
from logitstore.zarr_codec import GRID_ARRAYS, LogprobGrid, as_codes

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
        raise icechunk_failure(f"cannot read {what}", e) from None
    except (ValueError, RuntimeError) as e:  # zarr's CRC32C mismatch is a ValueError, a Blosc failure a RuntimeError
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DamagedDataError(f"{what} is damaged ({cause[:120]}); run `logitstore verify`") from None


class Store:
    """A versioned store at one location. Cheap to open; reads and writes go through versions."""

    def __init__(self, location: Location, repo: icechunk.Repository, blobs):
        self.location = location
        self.repo = repo
        self.blobs = blobs

    # -- opening ---------------------------------------------------------------------------------

    @classmethod
    def open(cls, uri: str, *, create: bool = False) -> Store:
        """Open the store at `uri`; with `create`, create it first if missing. Creation is idempotent:
        several processes creating one store at once all end up with the same, initialised store."""
        location = Location.parse(uri)
        if not create and location.scheme == "file" and not Path(location.path).exists():
            raise StoreNotFoundError(f"{location.uri} is not a logitstore store (no such folder)")  # and creates none
        storage, blobs = location.storage_and_blobs()
        with storage_errors(f"cannot open store {location.uri}"):
            repo = _open_or_create(storage, location) if create else _open_existing(storage, location)
            if create and _is_bare(repo):  # also finishes a creation killed between its two steps
                _initialise(repo, location)
        store = cls(location, repo, blobs)
        store._check_format()
        return store

    @classmethod
    def open_if_exists(cls, uri: str) -> Store | None:
        """The store at `uri`, or None where there is none yet (a location `open(create=True)` would
        create one in). A location holding something else is refused now, not at creation. For a job
        that creates its store with its first commit, so that failing before leaves nothing behind."""
        location = Location.parse(uri)
        if location.scheme == "file" and not Path(location.path).exists():
            return None  # before Icechunk's local storage, which makes the folder when opened
        storage, _ = location.storage_and_blobs()
        with storage_errors(f"cannot open store {location.uri}"):
            exists = repository_exists(storage, where=location.uri)
        if not exists:
            if not _only_repository_files(location):
                raise StoreNotFoundError(
                    f"{location.uri} exists and is not a logitstore store; refusing to write there"
                )
            return None
        return cls.open(uri, create=True)  # create=True also finishes a creation killed half-way

    def _check_format(self) -> None:
        try:
            with storage_errors(f"cannot read store {self.location.uri}"):
                tip = self.repo.lookup_branch(DEFAULT_BRANCH)
                self.repo.lookup_snapshot(tip)  # a damaged snapshot raises here; a zarr read would see no group
                meta = _root_attrs(self.repo.readonly_session(snapshot_id=tip)).get("logitstore")
        except DamagedDataError:
            return  # main's tip is damaged; tags and older versions may be whole, and reading main says so
        if meta is None:
            raise StoreNotFoundError(f"{self.location.uri} is an Icechunk repository but not a logitstore store")
        if meta.get("format", 0) > FORMAT_VERSION:
            raise IncompatibleStoreError(
                f"{self.location.uri} has store format {meta['format']}; this logitstore reads up to {FORMAT_VERSION}"
            )

    # -- versions ----------------------------------------------------------------------------------

    def resolve(self, version: str | None = None) -> str:
        """Snapshot id for a tag, a branch or a snapshot id; None means the tip of `main`."""
        version = version or DEFAULT_BRANCH
        with storage_errors(f"store {self.location.uri}"):
            tags = self.repo.list_tags()
            if version in tags and version in self.repo.list_branches():  # made before names were checked
                raise VersionNotFoundError(
                    f"{version!r} is both a tag and a branch of {self.location.uri}; remove the "
                    f"tag with `logitstore tag {self.location.uri} {version} --delete`"
                )
            if version in tags:
                return self.repo.lookup_tag(version)
            if version in self.repo.list_branches():
                return self.repo.lookup_branch(version)
            if SNAPSHOT_ID.fullmatch(version):
                try:
                    return self.repo.lookup_snapshot(version).id
                except icechunk.IcechunkError:
                    pass
        with storage_errors(f"store {self.location.uri}"):
            branches, tags = sorted(self.repo.list_branches()), sorted(self.repo.list_tags())
        raise VersionNotFoundError(
            f"{self.location.uri} has no version, tag or branch {version!r} "
            f"(branches: {', '.join(branches)}; tags: {', '.join(tags) or 'none'})"
        )

    def log(self, version: str | None = None) -> list[VersionInfo]:
        """Versions reachable from `version` (default: the tip of main), newest first, with their tags."""
        tip = self.resolve(version)
        tags_at: dict[str, list[str]] = {}
        with storage_errors(f"store {self.location.uri}"):
            for tag in sorted(self.repo.list_tags()):
                tags_at.setdefault(self.repo.lookup_tag(tag), []).append(tag)
            history = [snap for snap in self.repo.ancestry(snapshot_id=tip) if snap.parent_id is not None]
            return [_version_info(snap, tags_at.get(snap.id, [])) for snap in history]

    def tag(self, name: str, *, version: str | None = None) -> str:
        snapshot = self.resolve(version)
        self._check_ref_name(name, kind="tag")
        with storage_errors(f"cannot create tag {name!r}"), commit_lock(self.location):
            try:
                self.repo.create_tag(name, snapshot)
            except icechunk.IcechunkError as e:
                if "already exists" not in str(e):
                    raise
                # Icechunk keeps a deleted tag's name reserved, so a name never points at two versions.
                raise LogitstoreError(
                    f"tag {name!r} was deleted and its name cannot be reused; choose another"
                ) from None
        return snapshot

    def delete_tag(self, name: str) -> str:
        """Remove a tag (the version it named stays, reachable by id or other names). Returns that id."""
        with storage_errors(f"cannot delete tag {name!r}"):
            if name not in self.repo.list_tags():
                raise VersionNotFoundError(
                    f"{self.location.uri} has no tag {name!r} "
                    f"(tags: {', '.join(sorted(self.repo.list_tags())) or 'none'})"
                )
            snapshot = self.repo.lookup_tag(name)
            with commit_lock(self.location):
                self.repo.delete_tag(name)
        return snapshot

    def create_branch(self, name: str, *, version: str | None = None) -> str:
        snapshot = self.resolve(version)
        self._check_ref_name(name, kind="branch")
        with storage_errors(f"cannot create branch {name!r}"), commit_lock(self.location):
            self.repo.create_branch(name, snapshot)
        return snapshot

    def _check_ref_name(self, name: str, *, kind: str) -> None:
        """Tags, branches and snapshot ids share one namespace in `resolve`: a new name must not shadow
        (or be shadowed by) another, or `train --version X` and `build --branch X` would read and
        write different things under one name."""
        if not NAME.fullmatch(name):
            raise LogitstoreError(f"{kind} name {name!r}: use letters, digits, '.', '_' and '-' (at most 128)")
        if SNAPSHOT_ID.fullmatch(name):
            raise LogitstoreError(f"{kind} name {name!r} looks like a version id; choose another")
        with storage_errors(f"store {self.location.uri}"):
            tags, branches = self.repo.list_tags(), self.repo.list_branches()
        if name in tags:
            with storage_errors(f"store {self.location.uri}"):
                at = self.repo.lookup_tag(name)
            raise LogitstoreError(
                f"tag {name!r} already exists (at {at}); tags never move"
                if kind == "tag"
                else f"{name!r} is already a tag (at {at}); a branch cannot have a tag's name"
            )
        if name in branches:
            raise LogitstoreError(
                f"branch {name!r} already exists"
                if kind == "branch"
                else f"{name!r} is a branch; a tag cannot have a branch's name"
            )

    def branches(self) -> dict[str, str]:
        with storage_errors(f"store {self.location.uri}"):
            return {b: self.repo.lookup_branch(b) for b in sorted(self.repo.list_branches())}

    # -- reading and writing -------------------------------------------------------------------

    def read(self, version: str | None = None) -> StoreVersion:
        return StoreVersion(self, self.resolve(version))

    def writer(self, *, branch: str = DEFAULT_BRANCH, on_duplicate: str = "error") -> StoreWriter:
        with storage_errors(f"cannot write to {self.location.uri}"):
            branches = self.repo.list_branches()
        if branch not in branches:
            raise VersionNotFoundError(f"{self.location.uri} has no branch {branch!r}; create it first")
        return StoreWriter(self, branch=branch, on_duplicate=on_duplicate)

    def index_key(self, snapshot_id: str) -> str | None:
        with storage_errors(f"store {self.location.uri}"):
            meta = self.repo.lookup_snapshot(snapshot_id).metadata or {}
        return meta.get("logitstore", {}).get("index")

    def read_index(self, snapshot_id: str) -> pa.Table:
        return index.read_index(self.blobs, self.index_key(snapshot_id))


def _open_existing(storage: icechunk.Storage, location: Location) -> icechunk.Repository:
    if not repository_exists(storage, where=location.uri):
        raise StoreNotFoundError(f"{location.uri} is not a logitstore store (no store there)")
    return open_repository(storage, where=location.uri)


def _open_or_create(storage: icechunk.Storage, location: Location) -> icechunk.Repository:
    """Create the repository unless it exists. Two processes may race here: Icechunk lets one create
    win (its first ref write is conditional) and the loser then opens what the winner made."""
    deadline = time.monotonic() + CREATE_WAIT_S
    while True:
        if repository_exists(storage, where=location.uri):
            return open_repository(storage, where=location.uri)
        if not _only_repository_files(location):
            raise StoreNotFoundError(f"{location.uri} exists and is not a logitstore store; refusing to write there")
        try:
            return create_repository(storage, where=location.uri)
        except icechunk.IcechunkError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # another process is creating it: open what it made


# How long a creation waits for a concurrent one before giving up; creating takes milliseconds.
CREATE_WAIT_S = 10.0
# What a local store folder may hold: Icechunk's folders and logitstore's files beside them.
_REPOSITORY_FILES = {
    "chunks",
    "manifests",
    "refs",
    "snapshots",
    "transactions",
    "config.yaml",
    "logitstore-index",
    ".logitstore-commit.lock",
}


def _only_repository_files(location: Location) -> bool:
    """A local folder that is missing, empty, or holds only a (possibly half-created) repository's files."""
    path = Path(location.path)
    if location.scheme != "file" or not path.exists():
        return True
    return path.is_dir() and all(entry.name in _REPOSITORY_FILES for entry in path.iterdir())


def _root_attrs(session: icechunk.Session) -> dict:
    try:
        return dict(zarr.open_group(session.store, mode="r").attrs)
    except zarr.errors.GroupNotFoundError:
        return {}


def _is_bare(repo: icechunk.Repository) -> bool:
    """Created by Icechunk but not yet initialised by logitstore: only Icechunk's first snapshot."""
    return len(list(repo.ancestry(branch=DEFAULT_BRANCH))) == 1


def _initialise(repo: icechunk.Repository, location: Location) -> None:
    session = repo.writable_session(DEFAULT_BRANCH)
    root = zarr.open_group(session.store, mode="a")
    if "teachers" in root:  # a concurrent creation initialised it between our look and this session
        return
    root.attrs["logitstore"] = {"format": FORMAT_VERSION, "created": _now(), "writer": WRITER}
    root.create_group("teachers")
    try:
        with commit_lock(location):
            session.commit("create logitstore store")
    except icechunk.ConflictError:
        if _is_bare(repo):  # not a concurrent creation: something else moved main
            raise
        # a concurrent creation initialised it first, the same way


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _version_info(snap: icechunk.SnapshotInfo, tags: list[str]) -> VersionInfo:
    meta = (snap.metadata or {}).get("logitstore", {})
    return VersionInfo(
        id=snap.id,
        message=snap.message,
        written_at=snap.written_at,
        parent_id=snap.parent_id,
        tags=tags,
        samples=meta.get("samples"),
        tokens=meta.get("tokens"),
    )


class StoreVersion:
    """A read-only view of one version: its index, its teachers, and decoded samples."""

    def __init__(self, store: Store, snapshot_id: str):
        self.store = store
        self.snapshot_id = snapshot_id
        with storage_errors(f"cannot read version {snapshot_id} of {store.location.uri}"):
            store.repo.lookup_snapshot(snapshot_id)  # a damaged snapshot raises here; through zarr it would look empty
            session = store.repo.readonly_session(snapshot_id=snapshot_id)
            if "logitstore" not in _root_attrs(session):
                raise VersionNotFoundError(f"version {snapshot_id} predates the creation of store {store.location.uri}")
            self.root = zarr.open_group(session.store, mode="r")
            self.teachers = _read_teachers(self.root)
        self.index = store.read_index(snapshot_id)
        self._rows: dict[tuple[str, str], int] | None = None
        self._arrays: dict[tuple[str, str, str], zarr.Array] = {}
        self._id_of_code: dict[str, np.ndarray] = {}

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
                    "sparsity": meta.sparsity,
                    "sparsity_mode": meta.sparsity["mode"],
                    "samples": rows.num_rows,
                    "tokens": int(pc.sum(rows["n_tokens"]).as_py() or 0),
                    "content_hash": meta.content_hash,
                    "tokenizer_hash": meta.tokenizer_hash,
                    "codec": meta.codec.to_json(),
                    "student_tokenizers": [self.student_info(name, s) for s in meta.student_names],
                    "engine": meta.engine,
                    "dtype": meta.dtype,
                    "engine_version": meta.engine_version,
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
        return sum(int(self.part_group(t, p).attrs["stored_bytes"]) for t, p in parts)

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

    def encoded_row(self, r: dict) -> EncodedSamples:
        """The stored integer arrays of one index row (a dict from `index.to_pylist()`)."""
        t, p = r["teacher"], r["part"]
        params = self.teachers[t].codec
        with read_errors(f"sample {r['sample_id']!r} of teacher {t!r} (part {p})"):
            names = [n for n in ENCODED_ARRAYS if n in self.part_group(t, p)]
            return slice_row(r, lambda name, rows: as_codes(self.array(t, p, name)[rows], params), names=names)

    def part_group(self, teacher: str, part: str) -> zarr.Group:
        return self.root[f"teachers/{teacher}/parts/{part}"]

    def array(self, teacher: str, part: str, name: str) -> zarr.Array:
        key = (teacher, part, name)
        if key not in self._arrays:
            self._arrays[key] = self.root[f"teachers/{teacher}/parts/{part}/{name}"]
        return self._arrays[key]

    def id_of_code(self, teacher: str) -> np.ndarray:
        if teacher not in self._id_of_code:
            with read_errors(f"the id order of teacher {teacher!r} (teachers/{teacher}/code_of_id)"):
                group = self.root[f"teachers/{teacher}"]
                codes = group["code_of_id"][:] if "code_of_id" in group else None
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
        return self.root[f"teachers/{teacher}/students/{student}"]

    def student_info(self, teacher: str, student: str) -> dict:
        """name, tokenizer_hash, vocab_size, mapped_ids, and `mapped_mass`: the mean share of the
        teacher's probability per position on tokens with an exact student counterpart (its stored
        entries only: the tail counts as unmapped), estimated on `mapped_mass_positions` positions."""
        return dict(self.student_group(teacher, student).attrs["logitstore_student"])

    def vocab_map(self, teacher: str, student: str) -> np.ndarray:
        group = self.student_group(teacher, student)
        with read_errors(f"the vocabulary map of student tokenizer {student!r} ({group.path}/vocab_map)"):
            return group["vocab_map"][:]

    def student_tokenizer(self, teacher: str, student: str):
        from tokenizers import Tokenizer

        group = self.student_group(teacher, student)
        return Tokenizer.from_str(_read_text(group, "tokenizer", what=f"student tokenizer {student!r}"))

    def student_tokens(self, sample_id: str, *, teacher: str | None, student: str) -> tuple[np.ndarray, np.ndarray]:
        """(student ids [n], alignment groups [g, 4]) of one sample."""
        teacher = self.teacher_name(teacher)
        self.student_group(teacher, student)  # refuses an unknown name with a clear message
        k = self.teachers[teacher].student_names.index(student)
        r = self.index.slice(self.row_of(sample_id, teacher=teacher), 1).to_pylist()[0]
        base = f"teachers/{teacher}/parts/{r['part']}/students/{student}"
        with read_errors(f"student tokens of sample {sample_id!r} ({base})"):
            s0, n = r["student_start"][k], r["n_student_tokens"][k]
            g0, g = r["group_start"][k], r["n_groups"][k]
            ids = self.root[f"{base}/ids"][s0 : s0 + n]
            groups = self.root[f"{base}/groups"][4 * g0 : 4 * (g0 + g)].reshape(-1, 4)
        return ids.astype(np.int64), groups.astype(np.int64)

    def tokenizer(self, teacher: str | None = None):
        """The teacher's `tokenizers.Tokenizer` if the store keeps one, else None."""
        name = self.teacher_name(teacher)
        group = self.root[f"teachers/{name}"]
        if "tokenizer" not in group:
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_str(_read_text(group, "tokenizer", what=f"the tokenizer of teacher {name!r}"))


def _read_text(group: zarr.Group, name: str, *, what: str) -> str:
    """A stored UTF-8 document (a tokenizer.json), as text."""
    with read_errors(f"{what} ({group.path}/{name})"):
        data = bytes(group[name][:])
        return data.decode("utf-8")


ENCODED_ARRAYS = (
    "input_ids",
    "n_entries",
    "entry_codes",
    "entry_logprobs",
    "tail",
    "target_logprobs",
    "entry_counts",
    "loss_mask",
)
_ROW_AXIS = {
    "input_ids": "token",
    "loss_mask": "token",
    "n_entries": "position",
    "tail": "position",
    "target_logprobs": "position",
    "entry_codes": "entry",
    "entry_logprobs": "entry",
    "entry_counts": "entry",
}


def slice_row(row: dict, read, *, names) -> EncodedSamples:
    """One sample's `EncodedSamples`, with `read(name, slice)` fetching rows of a part's array."""
    rows = {
        "token": slice(row["token_start"], row["token_start"] + row["n_tokens"]),
        "position": slice(row["position_start"], row["position_start"] + row["n_tokens"] - 1),
        "entry": slice(row["entry_start"], row["entry_start"] + row["n_entries"]),
    }
    return EncodedSamples(**{name: read(name, rows[_ROW_AXIS[name]]) for name in names})


def _read_teachers(root: zarr.Group) -> dict[str, TeacherMeta]:
    if "teachers" not in root:
        return {}
    return {name: TeacherMeta.from_json(g.attrs["logitstore_teacher"]) for name, g in root["teachers"].groups()}


class StoreWriter:
    """One transaction on a branch. Nothing is visible until `commit`; leaving the `with` block
    without committing (or crashing) discards everything written.

    `on_duplicate` decides what happens to a sample id the branch already holds for that teacher:
    "error" (default) refuses the write, "replace" makes the new sample win, "skip" keeps the old one
    and drops the new (what a resumed build wants).
    """

    def __init__(self, store: Store, *, branch: str, on_duplicate: str):
        if on_duplicate not in ("error", "replace", "skip"):
            raise ValueError(f"on_duplicate must be 'error', 'replace' or 'skip', got {on_duplicate!r}")
        self.store = store
        self.branch = branch
        self.on_duplicate = on_duplicate
        with storage_errors(f"cannot write to {store.location.uri}"):
            self.session = store.repo.writable_session(branch)
            self.root = zarr.open_group(self.session.store, mode="r+")
        self.base_snapshot = self.session.snapshot_id
        self.teachers = _read_teachers(self.root)
        self._base_keys = _keys(store.read_index(self.base_snapshot))
        self._new_rows: list[pa.Table] = []
        self._new_keys: set[tuple[str, str]] = set()
        self._committed: str | None = None
        self._fork_source: icechunk.Session | None = None
        self._added_teachers: list[str] = []
        self._removed: set[tuple[str, str]] = set()
        # Each teacher's id order (`code_of_id`), shared by every part writer and fork of this writer:
        # read once, not once per part (reading it cost ~14 ms per 16k-token part, a third of a write).
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
        students: list[StudentTokenizer] = (),
    ) -> TeacherMeta:
        """Register a teacher (with its student tokenizers), or check that `meta` matches the one
        already in the store. `meta.students` is filled from `students`."""
        meta = TeacherMeta.from_json({**meta.to_json(), "students": [st.summary() for st in students]})
        existing = self.teachers.get(meta.name)
        if existing is not None:
            if not existing.same_teacher(meta):
                raise IncompatibleStoreError(_mismatch_message(existing, meta))
            return existing
        meta = TeacherMeta.from_json({**meta.to_json(), "created": _now(), "writer": WRITER})
        group = self.root.require_group("teachers").create_group(meta.name)
        group.attrs["logitstore_teacher"] = meta.to_json()
        group.create_group("parts")  # here, not in forks: two forks creating it would conflict
        self._added_teachers.append(meta.name)
        if meta.values == "logprobs" and self.root.attrs["logitstore"].get("format", 1) < 2:
            # an older store gains a format-2 teacher: older logitstores now refuse it in one line
            self.root.attrs["logitstore"] = {**self.root.attrs["logitstore"], "format": FORMAT_VERSION}
        if meta.codec.id_order == "frequency":
            assert code_of_id is not None and len(code_of_id) == meta.vocab_size, "frequency order needs code_of_id"
            _write_array(group, "code_of_id", np.asarray(code_of_id, dtype=np.uint32))
            self._codes[meta.name] = np.asarray(code_of_id, dtype=np.uint32)
        if tokenizer_json is not None:
            _write_array(group, "tokenizer", np.frombuffer(tokenizer_json.encode("utf-8"), dtype=np.uint8))
        for st in students:
            sub = group.require_group("students").create_group(st.name)
            sub.attrs["logitstore_student"] = {
                **st.summary(),
                "mapped_mass": st.mapped_mass,
                "mapped_mass_positions": st.mapped_mass_positions,
                "mapped_ids": int((st.vocab_map >= 0).sum()),
            }
            _write_array(sub, "tokenizer", np.frombuffer(st.tokenizer_json.encode("utf-8"), dtype=np.uint8))
            _write_array(sub, "vocab_map", np.asarray(st.vocab_map, dtype=np.int32))
        self.teachers[meta.name] = meta
        return meta

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
        keep = self._apply_duplicate_rule(teacher, samples.sample_ids)
        if not keep:
            return 0
        if len(keep) < len(samples):
            samples, source_hashes = _subset(samples, keep, source_hashes)
            students = None if students is None else {n: st.select(keep) for n, st in students.items()}
        written = self.part_writer().write(samples, teacher=teacher, source_hashes=source_hashes, students=students)
        self._add_rows(written.rows)
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
        """Take a forked writer's part into this transaction. Returns the samples it adds."""
        if written.fork is not None:
            with storage_errors(f"cannot merge a forked writer into {self.store.location.uri}"):
                self.session.merge(written.fork)
        rows = written.rows
        if rows.num_rows:
            teacher = rows["teacher"][0].as_py()
            keep = self._apply_duplicate_rule(teacher, rows["sample_id"].to_pylist())
            rows = rows.take(pa.array(keep, type=pa.int64()))  # typed: an empty list would be null-typed
        self._add_rows(rows)
        return rows.num_rows

    def remove(self, teacher: str, sample_ids: list[str]) -> None:
        """Drop these samples of the base version from the index at commit (their parts stay, unreferenced:
        older versions still read them). A removed id may then be written again in this transaction."""
        removed = {(teacher, sid) for sid in sample_ids} & self._base_keys
        self._base_keys -= removed
        self._removed |= removed

    def _add_rows(self, rows: pa.Table) -> None:
        self._new_rows.append(rows)
        self._new_keys.update(zip(rows["teacher"].to_pylist(), rows["sample_id"].to_pylist()))

    def _apply_duplicate_rule(self, teacher: str, sample_ids: list[str]) -> list[int]:
        dup = [
            i
            for i, sid in enumerate(sample_ids)
            if (teacher, sid) in self._base_keys or (teacher, sid) in self._new_keys
        ]
        if not dup:
            return list(range(len(sample_ids)))
        if self.on_duplicate == "error":
            first = [sample_ids[i] for i in dup[:3]]
            raise DuplicateSampleError(
                f"{len(dup)} sample id(s) already stored for teacher {teacher!r}, e.g. {first}; "
                "pass on_duplicate='replace' or 'skip'"
            )
        if self.on_duplicate == "replace":
            in_txn = [sample_ids[i] for i in dup if (teacher, sample_ids[i]) in self._new_keys]
            if in_txn:
                raise DuplicateSampleError(f"sample id {in_txn[0]!r} written twice in one transaction")
            return list(range(len(sample_ids)))
        dup_set = set(dup)
        return [i for i in range(len(sample_ids)) if i not in dup_set]

    # -- commit ----------------------------------------------------------------------------------

    def commit(self, message: str, *, max_attempts: int = 20) -> str:
        """Make everything staged visible as one new version. If another writer committed to the
        branch meanwhile, rebase onto it and merge the indexes; fail with `ConflictError` only when
        both wrote the same Zarr paths or the same sample ids. Returns the new version id."""
        assert self._committed is None, "a StoreWriter commits once"
        if not self.session.has_uncommitted_changes:
            if not self._removed:  # e.g. every sample skipped as already stored
                self._committed = self.session.snapshot_id
                return self._committed
            self._record_removal()  # Icechunk commits only a changed tree
        new_rows = pa.concat_tables(self._new_rows) if self._new_rows else index.empty_index()
        for _ in range(max_attempts):
            base = self.store.read_index(self.session.snapshot_id)
            merged = self._merge(base, new_rows)
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
                return self._committed
            except icechunk.ConflictError:
                self._rebase()
        raise ConflictError(f"branch {self.branch!r} kept moving; gave up after {max_attempts} attempts")

    def _record_removal(self) -> None:
        """A removal alone changes only the index: record it as an empty part of its own, a new path
        that no concurrent writer touches."""
        teacher = sorted(self._removed)[0][0]
        with storage_errors(f"cannot write to {self.store.location.uri}"):
            group = self.root[f"teachers/{teacher}/parts"].create_group(_new_part_name())
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

    def _merge(self, base: pa.Table, new_rows: pa.Table) -> pa.Table:
        present = _keys(base) - self._removed  # what the branch holds and this write does not remove
        clash = present & _keys(new_rows) - self._base_keys  # ids a concurrent writer added meanwhile
        if clash and self.on_duplicate == "error":
            raise ConflictError(f"a concurrent write added sample(s) {sorted(clash)[:3]} that this write also holds")
        new_keys = _keys(new_rows)
        if self.on_duplicate == "skip":
            new_rows = new_rows.filter(pc.invert(_key_mask(new_rows, present)))
            new_keys = _keys(new_rows)
        kept = base.filter(pc.invert(_key_mask(base, new_keys | self._removed)))
        return pa.concat_tables([kept, new_rows])


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
        self.__init__(state["session"], teachers=state["teachers"], where=state["where"], codes=state.get("codes"))

    def write(
        self,
        samples: SparseSamples,
        *,
        teacher: str,
        source_hashes: list[str | None] | None = None,
        students: dict[str, StudentTokens] | None = None,
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
                f"teacher {teacher!r} is {meta.sparsity['mode']}: entry_counts must be "
                f"{'given' if meta.sampled else 'absent'}"
            )
        store = bounded_store(self.session.store, where=self.where)  # a fork's store is bare
        code_of_id = self.code_of_id(teacher)
        enc = codec.encode(samples, params=meta.codec, code_of_id=code_of_id, vocab_size=meta.vocab_size)
        part = _new_part_name()
        # The same groups, arrays and bytes as writing each array with `_write_array`, in ~1/4 of the
        # time (see rawwrite.py): compression runs in threads while this one hashes the index rows.
        arrays = dict(enc.arrays())
        for st, info in zip(ordered, meta.students):
            arrays[f"students/{info['name']}/ids"] = st.ids.astype(np.int32)
            arrays[f"students/{info['name']}/groups"] = st.groups.astype(np.int32).reshape(-1)
            if (st.loss_mask is not None) != (meta.loss_mask is not None):
                raise InvalidSampleError(
                    f"student tokens of {info['name']!r}: loss_mask must be "
                    f"{'given' if meta.loss_mask else 'absent'} for this teacher"
                )
            if st.loss_mask is not None:
                arrays[f"students/{info['name']}/loss_mask"] = st.loss_mask.astype(np.uint8)
        path = f"teachers/{teacher}/parts/{part}"
        grids = {name: meta.grid for name in GRID_ARRAYS}
        pending = rawwrite.encode_arrays(
            {f"{path}/{name}": (values, _array_kwargs(values, grid=grids.get(name))) for name, values in arrays.items()}
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
        stored = sum(a.nbytes for a in encoded.values())
        attrs = {"samples": len(samples), "tokens": int(samples.n_tokens.sum()), "stored_bytes": stored}
        documents = {f"{path}/zarr.json": rawwrite.group_document(attrs)}
        if ordered:
            documents[f"{path}/students/zarr.json"] = rawwrite.group_document({})
            documents.update(
                {f"{path}/students/{info['name']}/zarr.json": rawwrite.group_document({}) for info in meta.students}
            )
        with storage_errors(f"cannot write to {self.where}"):
            rawwrite.write_objects(store, documents=documents, arrays=encoded)
        is_fork = isinstance(self.session, icechunk.ForkSession)
        return WrittenPart(rows=rows, stored_bytes=stored, fork=self.session if is_fork else None)

    def code_of_id(self, teacher: str) -> np.ndarray:
        """The teacher's id order (token id -> stored code), read once per `StoreWriter`."""
        if teacher not in self._codes:
            with read_errors(f"the id order of teacher {teacher!r} (teachers/{teacher}/code_of_id)"):
                group = zarr.open_group(bounded_store(self.session.store, where=self.where), mode="r")[
                    f"teachers/{teacher}"
                ]
                codes = (
                    group["code_of_id"][:]
                    if "code_of_id" in group
                    else codec.identity_order(self.teachers[teacher].vocab_size)
                )
            self._codes[teacher] = codes  # uint32: the encoder takes any integer type
        return self._codes[teacher]


def _new_part_name() -> str:
    """Unique across processes and machines, and ordered by time for people reading the tree."""
    return f"{time.time_ns():x}-{secrets.token_hex(4)}"


def _keys(table: pa.Table) -> set[tuple[str, str]]:
    return set(zip(table["teacher"].to_pylist(), table["sample_id"].to_pylist()))


def _key_mask(table: pa.Table, keys: set[tuple[str, str]]) -> pa.Array:
    joined = pc.binary_join_element_wise(table["teacher"], table["sample_id"], "\x00")
    return pc.is_in(joined, value_set=pa.array([f"{t}\x00{s}" for t, s in keys], pa.string()))


def _subset(samples: SparseSamples, keep: list[int], source_hashes):
    from logitstore.samples import concat

    picked = concat([samples.select(i) for i in keep])
    return picked, None if source_hashes is None else [source_hashes[i] for i in keep]


def _write_array(group: zarr.Group, name: str, values: np.ndarray, *, grid: CodecParams | None = None) -> int:
    """Write a 1-D array sharded for object storage; returns its compressed size in bytes. Through Zarr:
    for the per-teacher arrays, written once; parts go through `rawwrite` in the same layout. With
    `grid`, `values` are uint16 codes, written as the float32 log-probabilities they stand for."""
    array = group.create_array(name, **_array_kwargs(values, grid=grid))
    if len(values):
        array[:] = values if grid is None else codec.dequantize(values, params=grid)
    return int(array.nbytes_stored())


def _array_kwargs(values: np.ndarray, *, grid: CodecParams | None = None) -> dict:
    """How a 1-D array is laid out (`zarr.create_array`'s arguments): one definition for both write paths.
    With `grid`, the array is float32 log-probabilities stored as these uint16 codes (`zarr_codec.py`)."""
    itemsize = values.dtype.itemsize
    chunk = max(1, CHUNK_BYTES // itemsize)
    n_chunks = max(1, -(-len(values) // chunk))
    shard = chunk * min(CHUNKS_PER_SHARD, n_chunks)
    blosc = BloscCodec(
        typesize=itemsize, cname="zstd", clevel=BLOSC_LEVEL, shuffle="shuffle" if itemsize > 1 else "noshuffle"
    )
    if grid is not None:
        assert values.dtype == np.uint16, "grid-coded arrays are written from their uint16 codes"
        return dict(
            shape=values.shape,
            dtype=np.float32,
            chunks=(chunk,),
            shards=(shard,),
            filters=[LogprobGrid.of(grid)],
            compressors=[blosc, Crc32cCodec()],
            fill_value=0.0,
        )
    return dict(
        shape=values.shape,
        dtype=values.dtype,
        chunks=(chunk,),
        shards=(shard,),
        compressors=[blosc, Crc32cCodec()],
        fill_value=0,
    )


def _mismatch_message(old: TeacherMeta, new: TeacherMeta) -> str:
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
